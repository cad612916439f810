"""`python -m server.cli ...` runs the `ember` command (the tests and scripts start servers this way)."""
import sys

from server.cli.main import main

sys.exit(main())
