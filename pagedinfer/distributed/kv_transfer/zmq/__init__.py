"""`ZmqConnector`: prompt KV straight from a prefill instance to a decode instance over TCP
(ZeroMQ), pulled by the decode side as vLLM's NixlConnector does.

    client/proxy            prefill (kv_producer)                 decode (kv_consumer)
    ------------            ---------------------                 --------------------
    request, max_tokens=1,  computes the prompt; its blocks are
    {"do_remote_decode":    held for a remote reader (a lease of
     true}           ---->  `lease_timeout_s`, default 120 s)
                    <----   kv_transfer_params: remote host, port,
                            engine id, request id, prompt length,
                            prompt hash
    same prompt, with those params  ---------------------------->  allocates the blocks,
                                                                   pulls tokens
                            the server thread answers the pull <-- [start, start + n)
                            and releases the hold                  into them, computes
                                                                   the last prompt token

The connector is split by role, as vLLM splits NixlConnector:

- `connector.py`: `ZmqConnector`, the `KVConnectorBase` facade; by `KVConnectorRole` it
  holds one of the two sides below and forwards each method to it.
- `scheduler.py`: `ZmqConnectorScheduler`, in the scheduler process: which loads to start
  (consumer), which prompts' blocks to hold and which holds to cancel (producer), and the
  `kv_transfer_params` returned to the client.
- `worker.py`: `ZmqConnectorWorker`, in each worker: applies the step's holds, cancels and
  loads, scatters the pulled KV into the paged cache and reports what finished.
- `server.py`: `KVServer`, the producer's server thread and the holds it serves.
- `puller.py`: `KVPuller`, the consumer's load threads and their sockets.
- `wire.py`: the pull protocol: msgspec headers, raw layer frames, checksums.

What the two sides exchange (in `KVConnectorMetadata`, a `KVTransferSpec` each):
- a load: `params` `{host, port, engine_id, request_id}` of the producer's held request,
  tokens `[start, start + num_tokens)`; `num_tokens == 0` only releases the remote hold.
- a hold: the prompt's blocks and length, pullable after the step's forward pass.
- a cancel: a hold spec with `num_tokens == 0` and `params {"cancel": True, "report": r}`;
  `r` tells whether the worker reports the request in `finished_sending` (an aborted
  request, whose blocks the scheduler still holds) or not (a preempted one, whose blocks
  the scheduler has freed).
"""
