"""The client-side tools: `ember bench` (load.py, a load generator for any OpenAI-compatible server, with its
client, prompts, report, RSS monitor and the peer comparison table) and `ember bench-engine` (engine.py).

Imports only from itself and from `engine` (load.py and its helpers not even that); never from server.api or
server.cli."""
