// Checks the Kubernetes manifests under deploy/kubernetes without a cluster: every document
// parses, and the fields that matter agree with each other — probes on levee's real paths
// and named ports with thresholds that neither flap nor outlast the drain's grace, the
// preStop drain and the grace periods it needs, non-root, Service and PodDisruptionBudget
// selectors, and the KEDA ScaledObject's target and query.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, readdirSync } from "node:fs";
import { join, dirname } from "node:path";
import { fileURLToPath } from "node:url";
import { parseAllDocuments } from "yaml";

const dir = join(dirname(fileURLToPath(import.meta.url)), "..", "kubernetes");

function load() {
  const docs = [];
  for (const f of readdirSync(dir).filter((f) => f.endsWith(".yaml")).sort()) {
    for (const d of parseAllDocuments(readFileSync(join(dir, f), "utf8"))) {
      assert.equal(d.errors.length, 0, `${f}: ${d.errors.join("; ")}`);
      const obj = d.toJS();
      if (obj) docs.push({ file: f, obj });
    }
  }
  return docs;
}

const docs = load();
const toml = readFileSync(join(dir, "levee.toml"), "utf8");
const tomlNumber = (key) => {
  const m = new RegExp(`^${key}\\s*=\\s*([0-9.]+)`, "m").exec(toml);
  assert.ok(m, `levee.toml sets ${key}`);
  return Number(m[1]);
};
const find = (kind, name) => docs.map((d) => d.obj).find((o) => o.kind === kind && (!name || o.metadata?.name === name));
const matches = (selector, labels) => Object.entries(selector).every(([k, v]) => labels?.[k] === v);

test("every document has apiVersion, kind and a name", () => {
  for (const { file, obj } of docs) {
    assert.ok(obj.apiVersion && obj.kind, `${file}: apiVersion and kind`);
    if (obj.kind !== "Kustomization") assert.ok(obj.metadata?.name, `${file}: ${obj.kind} has a name`);
  }
});

test("levee Deployment: probes, ports, drain hook, grace, non-root", () => {
  const dep = find("Deployment", "levee");
  assert.ok(dep, "a Deployment named levee");
  const pod = dep.spec.template.spec;
  const c = pod.containers.find((c) => c.name === "levee");
  const ports = Object.fromEntries(c.ports.map((p) => [p.name, p.containerPort]));
  assert.deepEqual(ports, { public: 8080, admin: 9090 });
  assert.equal(c.readinessProbe.httpGet.path, "/readyz");
  assert.equal(c.livenessProbe.httpGet.path, "/healthz");
  for (const probe of [c.readinessProbe, c.livenessProbe]) {
    assert.ok(probe.httpGet.port in ports, `probe port ${probe.httpGet.port} is a container port`);
  }
  const hook = c.lifecycle.preStop.exec.command;
  assert.equal(hook[1], "drain", `preStop runs levee drain: ${hook}`);
  assert.ok(hook.includes("http://127.0.0.1:9090"), "drains through the admin port");
  const timeout = Number(hook[hook.indexOf("--timeout-secs") + 1]);
  const grace = tomlNumber("shutdown_grace_ms") / 1000;
  assert.ok(pod.terminationGracePeriodSeconds > timeout + grace,
    `grace period ${pod.terminationGracePeriodSeconds} s covers drain ${timeout} s + shutdown ${grace} s`);
  assert.match(toml, /public = "0\.0\.0\.0:8080"/);
  assert.match(toml, /admin = "0\.0\.0\.0:9090"/);
  assert.equal(pod.securityContext.runAsNonRoot, true);
  assert.equal(c.securityContext.allowPrivilegeEscalation, false);
  const token = c.env.find((e) => e.name === "LEVEE_ADMIN_TOKEN");
  assert.ok(token?.valueFrom?.secretKeyRef, "the admin token comes from a Secret");
  const vol = pod.volumes.find((v) => v.configMap);
  assert.ok(vol && c.volumeMounts.some((m) => m.name === vol.name && m.mountPath === "/etc/levee"));
  assert.ok(c.args.includes("/etc/levee/levee.toml"));
  const kust = find("Kustomization");
  const gen = kust.configMapGenerator.find((g) => g.name === vol.configMap.name);
  assert.deepEqual(gen?.files, ["levee.toml"], "the ConfigMap is generated from levee.toml");
  const files = readdirSync(dir);
  for (const r of kust.resources) assert.ok(files.includes(r), `kustomization resource ${r} exists`);
});

test("readiness means able to serve, and the preStop drain outlasts the endpoints' update", () => {
  const dep = find("Deployment", "levee");
  const pod = dep.spec.template.spec;
  const c = pod.containers.find((c) => c.name === "levee");
  const ready = c.readinessProbe;
  const live = c.livenessProbe;
  // One slow answer must not take a replica out of the Service: replicas under the same
  // load would leave together, and clients would get the ingress's errors, not levee's 429.
  assert.ok(ready.failureThreshold >= 2, `readiness failureThreshold ${ready.failureThreshold} >= 2`);
  assert.ok(live.failureThreshold >= 3, `liveness failureThreshold ${live.failureThreshold} >= 3`);
  for (const [name, p] of [["readiness", ready], ["liveness", live]]) {
    assert.ok((p.timeoutSeconds ?? 1) <= (p.periodSeconds ?? 10), `${name}: timeout within the period`);
  }
  assert.ok(live.periodSeconds * live.failureThreshold >= 30, "liveness gives a stalled process 30 s");
  // The drain first keeps serving with /readyz at 503 for drain_grace_ms: longer than the
  // probe takes to see it (an operator's drain: endpoints follow the probe), and shorter than
  // the hook's whole timeout, which also waits for queued and in-flight requests.
  const drainGrace = tomlNumber("drain_grace_ms") / 1000;
  const detect = ready.periodSeconds * ready.failureThreshold;
  assert.ok(drainGrace > detect, `drain grace ${drainGrace} s > readiness detection ${detect} s`);
  const hook = c.lifecycle.preStop.exec.command;
  assert.deepEqual(hook.slice(0, 2), ["/usr/local/bin/levee", "drain"], "an exec hook: the image has no shell");
  const timeout = Number(hook[hook.indexOf("--timeout-secs") + 1]);
  assert.ok(timeout >= drainGrace + 10, `drain timeout ${timeout} s leaves 10 s after the ${drainGrace} s grace`);
  assert.ok(pod.terminationGracePeriodSeconds > timeout, "SIGTERM comes after the hook");
});

test("Services and the PodDisruptionBudget select the pods they mean", () => {
  const dep = find("Deployment", "levee");
  const labels = dep.spec.template.metadata.labels;
  const c = dep.spec.template.spec.containers[0];
  const portNames = c.ports.map((p) => p.name);
  for (const name of ["levee", "levee-admin"]) {
    const svc = find("Service", name);
    assert.ok(svc, `Service ${name}`);
    assert.ok(matches(svc.spec.selector, labels), `${name} selects levee pods`);
    for (const p of svc.spec.ports) assert.ok(portNames.includes(p.targetPort), `${name} → ${p.targetPort}`);
  }
  const pdb = find("PodDisruptionBudget", "levee");
  assert.ok(matches(pdb.spec.selector.matchLabels, labels));
  assert.ok(pdb.spec.minAvailable >= 1 && pdb.spec.minAvailable < dep.spec.replicas,
    "PDB keeps one pod up and still lets a node drain");
  assert.equal(dep.spec.strategy.rollingUpdate.maxUnavailable, 0);
});

test("KEDA scales the backends on levee's recommendation", () => {
  const so = find("ScaledObject");
  assert.ok(so, "a ScaledObject");
  const target = find(so.spec.scaleTargetRef.kind, so.spec.scaleTargetRef.name);
  assert.ok(target, "its target is in the manifests");
  assert.notEqual(target.metadata.name, "levee", "it scales the backends, not levee");
  const trig = so.spec.triggers[0];
  assert.equal(trig.type, "prometheus");
  // The fleet's load: the sum over levee replicas, never the max of per-replica figures.
  assert.match(trig.metadata.query, /^ceil\(sum\(levee_offered_load\{model="llama"\}\) \/ \(\d+ \* [0-9.]+\)\) \+ \d+$/);
  assert.doesNotMatch(trig.metadata.query, /max\(/);
  assert.equal(trig.metricType, "AverageValue");
  assert.equal(trig.metadata.threshold, "1");
  const backends = toml.match(/url = "http:\/\/vllm-\d+\.vllm:8000"/g).length;
  assert.equal(so.spec.maxReplicaCount, backends, "every replica KEDA may start is a levee backend");
  const hs = find("Service", target.spec.serviceName);
  assert.equal(hs?.spec.clusterIP, "None", "a headless Service gives replicas stable names");
});

test("the Compose quickstart: levee in front of an engine, listening on 0.0.0.0", () => {
  const composeDir = join(dir, "..", "compose");
  const compose = parseAllDocuments(readFileSync(join(composeDir, "compose.yaml"), "utf8"))[0].toJS();
  const { engine, levee } = compose.services;
  assert.ok(engine && levee, "services engine and levee");
  assert.deepEqual(engine.command.slice(0, 3), ["engine", "--host", "0.0.0.0"]);
  assert.equal(levee.command.at(-1), "/etc/levee/levee.toml");
  const [src, dst] = levee.volumes[0].split(":");
  assert.equal(dst, "/etc/levee", "the config directory is mounted (reloads see a save)");
  const cfg = readFileSync(join(composeDir, src, "levee.toml"), "utf8");
  assert.match(cfg, /public = "0\.0\.0\.0:8080"/);
  assert.match(cfg, /url = "http:\/\/engine:8000"/);
  assert.match(levee.environment.LEVEE_ADMIN_TOKEN, /:\?/, "the admin token is required");
  assert.ok(levee.ports.includes("127.0.0.1:9090:9090"), "admin on the host's loopback only");
});
