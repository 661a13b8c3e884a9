"""HTTP protocol layer: the Starlette app, protocol encoders, errors and security middleware."""
