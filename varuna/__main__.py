"""``python -m varuna`` is the ``varuna`` command."""

from __future__ import annotations

import sys

from varuna.cli import main

sys.exit(main())
