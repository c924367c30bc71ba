"""``lattice serve``: an OpenAI-compatible HTTP server over one loaded model (needs the ``serve`` extra).

Modules: `app` (routes), `schemas` (request validation), `engine` (the model and one generation), `queue`
(the bounded worker), `stops` (stop strings), `responses` (OpenAI bodies, SSE), `metrics` (Prometheus),
`errors` (OpenAI's error schema), `command` (the CLI sub-command).
"""
