"""The engine: requests in, one scheduled step at a time, tokens out (the scheduler, the
KV block manager, the model runner and its CUDA graphs, the sync and async front doors)."""
