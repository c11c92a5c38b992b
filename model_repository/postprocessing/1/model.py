from specdec.serving.text_models import Postprocessing as TritonPythonModel

__all__ = ["TritonPythonModel"]
