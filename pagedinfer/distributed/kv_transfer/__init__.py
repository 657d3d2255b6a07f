"""KV transfer between engine instances (disaggregated prefill/decode): the connector
interface (`base.py`), its per-step messages (`metadata.py`), the connectors and
`create_connector` (`factory.py`)."""
