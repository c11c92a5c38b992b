"""Where the project lives: `PROJECT_ROOT`, the checkout (in the image, /opt/specdec) that holds
specdec/, model_repository/, models/, loadtest/ and the run folder .run/.

The one definition: the entry points, build/, loadtest/ and tests import it from here.
"""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
