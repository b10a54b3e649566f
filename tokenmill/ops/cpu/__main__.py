"""`python -m tokenmill.ops.cpu`: build every CPU kernel now (make run does, before serving)."""

import logging

from tokenmill.ops.cpu.build import build_all

logging.basicConfig(level=logging.INFO, format="%(message)s")
build_all()
