"""KV transfer between engine instances (disaggregated prefill/decode): the connector
interface (`base.py`), the connectors and `create_connector` (`factory.py`). Their per-step
messages cross the scheduler/worker seam, so they live in `core/kv_transfer_metadata.py`."""
