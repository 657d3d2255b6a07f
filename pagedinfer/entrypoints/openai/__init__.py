"""The OpenAI-compatible server: `protocol` (request and response models), `serving_*`
(one handler per endpoint family, over an engine client) and `api_server` (the FastAPI app,
its routes and `build_app`, which `pagedinfer serve` runs)."""
