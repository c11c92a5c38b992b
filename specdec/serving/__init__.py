"""Triton glue: the classes behind model_repository/*/1/model.py.

Only this subpackage imports triton_python_backend_utils (present inside the Python backend
stub); everything it calls lives in the pure modules of specdec.
"""
