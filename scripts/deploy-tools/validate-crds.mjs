// Validates custom resources (KEDA, Prometheus Operator) against the schemas
// of their CRDs, as shipped by the kubernetes-models packages.
// Reads a JSON array of {source, object} from stdin; prints one line per
// problem and exits 1 if there is any.
// scripts/validate-deploy copies it beside node_modules, where imports resolve.
import { readFileSync } from "node:fs";

const models = {
  "keda.sh/v1alpha1": "@kubernetes-models/keda/keda.sh/v1alpha1/",
  "monitoring.coreos.com/v1": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/",
};

const items = JSON.parse(readFileSync(0, "utf8"));
let failed = 0;
for (const { source, object } of items) {
  const where = `${source}: ${object.kind}/${object.metadata?.name}`;
  const base = models[object.apiVersion];
  if (!base) {
    console.log(`${where}: no schema for ${object.apiVersion}`);
    failed++;
    continue;
  }
  try {
    const Model = (await import(base + object.kind))[object.kind];
    new Model(object).validate();
    console.log(`${where}: valid`);
  } catch (e) {
    console.log(`${where}: INVALID ${e.message}`);
    failed++;
  }
}
process.exit(failed ? 1 : 0);
