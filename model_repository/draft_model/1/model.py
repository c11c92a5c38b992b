from specdec.serving.engine_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
