"""Small example models named by the model.yaml files beside this package."""
