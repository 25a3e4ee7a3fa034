#!/usr/bin/env bash
# Create the Secrets the rlfabric manifests reference, once per namespace, with random values.
# Idempotent: an existing Secret is left as it is (rotate by deleting it first). Values are never
# printed. `make up TARGET=k8s` runs this before it applies the manifests.
#   rlfabric-redis  keys `password` (Redis `requirepass`) and `url` (redis://:PASSWORD@redis:6379/0, the
#                   file the services read with --redis-url-file); hex, so it needs no URL escaping
#   rlfabric-auth   key `token`: the service token (--auth-token-file) every mutating RPC requires
#   rlfabric-tls    optional, not created here: `kubectl -n NS create secret generic rlfabric-tls
#                   --from-file=tls.crt --from-file=tls.key --from-file=ca.crt`, used with the component
#                   deploy/k8s/components/tls (docs/security.md)
set -euo pipefail
NAMESPACE=${NAMESPACE:-rlfabric}
KUBECTL=${KUBECTL:-kubectl}

random_hex() { od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; }

# Through stdin, so a value never appears on a command line.
create() {  # NAME KEY=VALUE...
  local name=$1; shift
  { printf 'apiVersion: v1\nkind: Secret\nmetadata: {name: %s, namespace: %s}\nstringData:\n' "$name" "$NAMESPACE"
    for kv in "$@"; do printf '  %s: "%s"\n' "${kv%%=*}" "${kv#*=}"; done; } | "$KUBECTL" create -f - >/dev/null
  echo "secrets: created $NAMESPACE/$name"
}

"$KUBECTL" get namespace "$NAMESPACE" >/dev/null 2>&1 || "$KUBECTL" create namespace "$NAMESPACE"
for pair in rlfabric-redis:password rlfabric-redis:url rlfabric-auth:token; do
  name=${pair%%:*} key=${pair#*:}
  if "$KUBECTL" -n "$NAMESPACE" get secret "$name" >/dev/null 2>&1; then
    if [ "$key" = url ] && [ -z "$("$KUBECTL" -n "$NAMESPACE" get secret "$name" -o jsonpath='{.data.url}')" ]; then
      # A Secret from before the services read the URL from a file: add `url`, made from its password.
      password=$("$KUBECTL" -n "$NAMESPACE" get secret "$name" -o jsonpath='{.data.password}' | base64 -d)
      printf '{"stringData": {"url": "redis://:%s@redis:6379/0"}}' "$password" \
        | "$KUBECTL" -n "$NAMESPACE" patch secret "$name" --patch-file /dev/stdin >/dev/null
      echo "secrets: added url to $NAMESPACE/$name"
    else
      echo "secrets: $NAMESPACE/$name exists, kept"
    fi
  elif [ "$name" = rlfabric-redis ]; then
    password=$(random_hex)
    create "$name" "password=$password" "url=redis://:$password@redis:6379/0"
  else
    create "$name" "$key=$(random_hex)"
  fi
done
