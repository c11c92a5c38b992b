"""`python -m specdec.openai_api`: the service of specdec/openai_api/app.py."""

from specdec.openai_api.app import main

main()
