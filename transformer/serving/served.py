"""The code MLflow runs to build the served model (its "models from code"): the export carries this
file and the package, not a pickled object, so loading it needs only the code at hand. MLflow runs the
file on saving and on loading; importing it elsewhere only tells MLflow which model it names."""

import mlflow

from transformer.serving.serving import TranslationModel

mlflow.models.set_model(TranslationModel())
