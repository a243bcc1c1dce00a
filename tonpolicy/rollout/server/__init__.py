"""tonpolicy's embedded SGLang-protocol server: `app` (the HTTP server and its entry), `args`, `state`
(what the route handlers share), `model` (building and reloading the engine), `native_routes`,
`openai_routes`. Run it as `python -m tonpolicy.rollout.server`."""
