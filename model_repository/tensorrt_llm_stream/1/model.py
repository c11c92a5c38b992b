from specdec.serving.llmapi_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
