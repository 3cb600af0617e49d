"""``python -m signatures.mine``: build the upstream index (see :mod:`signatures.mine.build`)."""

import sys

from signatures.mine.build import main

sys.exit(main())
