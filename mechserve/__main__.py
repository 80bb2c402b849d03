"""``python -m mechserve``: the ``mechserve`` command."""

from __future__ import annotations

import sys

from mechserve.cli.main import main

sys.exit(main())
