"""The `ember` command line: the parser and dispatch (main.py), engine flags (engine_args.py), settings
resolution flag > env > config file > default (config_resolve.py), and one module per engine-side subcommand
(serve.py, compile.py, generate.py). The top of the import graph: it may import server.api, server.bench and
engine; nothing imports it."""
