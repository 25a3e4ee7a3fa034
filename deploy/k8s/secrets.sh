#!/usr/bin/env bash
# Create the Secrets the rlfabric manifests reference, once per namespace, with random values.
# Idempotent: an existing Secret is left as it is (rotate by deleting it first). Values are never
# printed. `make up TARGET=k8s` runs this before it applies the manifests.
#   rlfabric-redis  key `password`: Redis `requirepass`, also inside every pod's REDIS_URL (hex, so
#                   it needs no URL escaping)
#   rlfabric-auth   key `token`: bearer token of the privileged RPCs (reward verifier registry,
#                   rollout UpdateWeights)
#   rlfabric-tls    optional, not created here: `kubectl -n NS create secret generic rlfabric-tls
#                   --from-file=tls.crt --from-file=tls.key --from-file=ca.crt` (mounted, inert today)
set -euo pipefail
NAMESPACE=${NAMESPACE:-rlfabric}
KUBECTL=${KUBECTL:-kubectl}

random_hex() { od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; }

"$KUBECTL" get namespace "$NAMESPACE" >/dev/null 2>&1 || "$KUBECTL" create namespace "$NAMESPACE"
for pair in rlfabric-redis:password rlfabric-auth:token; do
  name=${pair%%:*} key=${pair#*:}
  if "$KUBECTL" -n "$NAMESPACE" get secret "$name" >/dev/null 2>&1; then
    echo "secrets: $NAMESPACE/$name exists, kept"
  else
    # Through stdin, so the value never appears on a command line.
    printf 'apiVersion: v1\nkind: Secret\nmetadata: {name: %s, namespace: %s}\nstringData: {%s: "%s"}\n' \
      "$name" "$NAMESPACE" "$key" "$(random_hex)" | "$KUBECTL" create -f - >/dev/null
    echo "secrets: created $NAMESPACE/$name"
  fi
done
