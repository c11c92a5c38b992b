from specdec.serving.text_models import Preprocessing as TritonPythonModel

__all__ = ["TritonPythonModel"]
