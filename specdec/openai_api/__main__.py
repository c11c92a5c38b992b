"""`python -m specdec.openai_api`: the service of specdec/openai_api/app.py."""

import signal

# Ctrl-C ends it at once and quietly until it serves (then uvicorn's handlers take over):
# not a KeyboardInterrupt traceback from whatever import it was in.
signal.signal(signal.SIGINT, signal.SIG_DFL)

from specdec.openai_api.app import main  # noqa: E402 - after the signal's disposition

main()
