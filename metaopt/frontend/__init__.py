"""Import: torch.nn.Module or ONNX file -> Program."""
