"""Several Triton replicas behind one L7 gRPC gateway: HAProxy, configured and run by us.

    python -m specdec.gateway serve --replicas 2 --openai  # `make serve REPLICAS=2`
    python -m specdec.gateway compose            # docker-compose.yml's gateway container
    python -m specdec.gateway drain              # a Kubernetes preStop: settle, then idle
    python -m specdec.gateway kubernetes-config  # deploy/kubernetes/base/gateway.yaml's
    python -m specdec.gateway compose-config     # compose's, without security settings

- `config.py`: haproxy.cfg for local replicas, Kubernetes pods and compose services; its
  docstring says why HAProxy and how it balances and checks;
- `security.py`: client keys, a bound per key, Triton's key on what it forwards, TLS
  (GATEWAY_KEYS_FILE, MAX_CONCURRENT_PER_KEY, GATEWAY_SSL_CERT; docs/scaling.md, Security);
- `serve.py`: running it: HAProxy as a child process, the local replicas, `serve`, and
  `compose` (the same settings, then HAProxy in the container's place);
- `drain.py`: a replica's preStop;
- `__main__.py`: the command line above.
"""
