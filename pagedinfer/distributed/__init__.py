"""Multi-process and multi-machine plumbing: shared-memory message queues, the typed wire
codec, and the tensor/pipeline process groups."""
