"""HTTP layer: FastAPI app, routes, schemas and error mapping. Never touches tensors."""
