"""`python -m moestream` runs the command line."""

import sys

from moestream.cli.main import main

sys.exit(main())
