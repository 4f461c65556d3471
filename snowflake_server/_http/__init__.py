"""The HTTP/JSON API: its routes, its OpenAPI document, its connections."""
