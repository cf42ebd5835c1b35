"""Demo model zoo: PyTorch definitions, generated data, training and ONNX export.

Nothing here imports Ray, and nothing at serving time imports this package:
replicas only need ONNX Runtime, the manifest and the tokenizer file.
"""
