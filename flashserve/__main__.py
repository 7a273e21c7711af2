"""``python -m flashserve generate ...``: the engine's commands (``python -m server serve``)."""

import sys

from flashserve.cli.main import main

sys.exit(main())
