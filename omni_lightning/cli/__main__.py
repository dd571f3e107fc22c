"""``python -m omni_lightning.cli``: the ``omni-lightning`` program (DDP's ranks start it this way too)."""

import sys

from omni_lightning.cli.entry import main

if __name__ == "__main__":
    sys.exit(main())
