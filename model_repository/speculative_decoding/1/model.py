from specdec.serving.bls_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
