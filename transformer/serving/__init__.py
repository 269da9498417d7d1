"""Serving: the model as an MLflow pyfunc, and its CTranslate2 export."""
