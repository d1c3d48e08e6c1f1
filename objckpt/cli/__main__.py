"""``python -m objckpt.cli``."""

from objckpt.cli import main

raise SystemExit(main())
