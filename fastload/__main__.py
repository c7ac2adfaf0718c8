"""``python -m fastload`` runs the CLI."""

import sys

from fastload.cli import main

sys.exit(main())
