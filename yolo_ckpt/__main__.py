"""``python -m yolo_ckpt`` is the ``yolo-ckpt`` command."""

import sys

from .integration.cli import main

sys.exit(main())
