"""``python -m yolo_ckpt`` is the ``yolo-ckpt`` command."""

import sys

from .cli import main

sys.exit(main())
