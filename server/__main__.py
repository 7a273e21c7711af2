"""``python -m server`` is the ``flashserve`` console script: ``python -m server serve ...``."""

import sys

from server.cli import main

sys.exit(main())
