#!/usr/bin/env bash
# Copies the repository's configs/ (the MindSpeed-RL YAMLs, their one home) into deploy/k8s/base/configs/,
# the ConfigMap sources of the kustomization: kustomize reads files only from inside a kustomization's
# root, so that plain `kubectl apply -k deploy/k8s/overlays/<platform>` works. Run it after editing
# configs/; tests/deploy/test_manifests.py fails while the two differ. A new file under configs/ must also
# be listed in deploy/k8s/base/kustomization.yaml (the same test names it).
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf deploy/k8s/base/configs
mkdir -p deploy/k8s/base/configs
cp -R configs/. deploy/k8s/base/configs/
echo "sync-configs: configs/ -> deploy/k8s/base/configs/"
