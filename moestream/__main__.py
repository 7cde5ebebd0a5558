"""`python -m moestream` runs the command line."""

import sys

from moestream.cli import main

sys.exit(main())
