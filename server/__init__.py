"""Everything of Ember above the engine: the HTTP API (api/), the `ember` command line and its configuration
(cli/), and the client-side benchmark tools (bench/). Imports point one way: cli -> api / bench -> engine."""
