#!/usr/bin/env python3
"""Package kvmesh_filter.wasm for Istio without a container daemon.

Writes an OCI image layout (https://github.com/opencontainers/image-spec/blob/main/image-layout.md)
by hand — `oci-layout`, `index.json`, `blobs/sha256/<digest>` — in one of the two formats Istio's
wasm fetcher accepts (istio/istio pkg/wasm/imagefetcher.go):

  compat    (default) one `application/vnd.oci.image.layer.v1.tar+gzip` layer holding `plugin.wasm`,
            manifest annotation `module.wasm.image/variant=compat` (solo-io wasm image spec,
            "compat" variant). Any registry and any OCI tool (skopeo, oras, crane) handles it.
  artifact  the solo-io "oci" variant: exactly two layers, the runtime config
            (`application/vnd.module.wasm.config.v1+json`) and the raw module
            (`application/vnd.module.wasm.content.layer.v1+wasm`). Needs a registry that accepts
            custom media types.

Everything is deterministic (tar mtime/uid 0, gzip mtime 0, sorted JSON keys), so one module always
gives the same manifest digest. The layout can be pushed with e.g.
  skopeo copy oci:target/wasm-oci:0.1.0 docker://REGISTRY/kvmesh/kvmesh-filter:0.1.0
and referenced as `oci://REGISTRY/kvmesh/kvmesh-filter:0.1.0` (WasmPlugin `sha256` = the manifest
digest printed here, without `sha256:`).

For `https://` or `file://` URLs no image is needed: `--http-out DIR` copies the module and writes
`<name>.sha256`; the WasmPlugin/EnvoyFilter `sha256` is the module's own digest.

`--check DIR` verifies a layout: every digest and size, media types, and that the module inside is
byte-identical to `--wasm` when given. Used by envoy/validate.sh.
"""
import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile

OCI_LAYOUT = {"imageLayoutVersion": "1.0.0"}
INDEX_MT = "application/vnd.oci.image.index.v1+json"
MANIFEST_MT = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG_MT = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_MT = "application/vnd.oci.image.layer.v1.tar+gzip"
WASM_CONFIG_MT = "application/vnd.module.wasm.config.v1+json"
WASM_LAYER_MT = "application/vnd.module.wasm.content.layer.v1+wasm"
VARIANT_ANNOTATION = "module.wasm.image/variant"
REF_NAME = "org.opencontainers.image.ref.name"
TITLE = "org.opencontainers.image.title"
WASM_MAGIC = b"\0asm"
ROOT_IDS = ["kvmesh", "kvmesh_service"]


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def sha256(data):
    return hashlib.sha256(data).hexdigest()


class Layout:
    def __init__(self, root):
        self.root = root
        self.blobs = os.path.join(root, "blobs", "sha256")

    def put(self, data, media_type, annotations=None):
        os.makedirs(self.blobs, exist_ok=True)
        digest = sha256(data)
        with open(os.path.join(self.blobs, digest), "wb") as f:
            f.write(data)
        desc = {"mediaType": media_type, "digest": "sha256:" + digest, "size": len(data)}
        if annotations:
            desc["annotations"] = annotations
        return desc


def compat_layer(wasm):
    """tar.gz with plugin.wasm, bit-for-bit reproducible."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("plugin.wasm")
        info.size = len(wasm)
        info.mode = 0o444
        info.mtime = 0
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        tar.addfile(info, io.BytesIO(wasm))
    gz = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=gz, mtime=0) as z:
        z.write(raw.getvalue())
    return raw.getvalue(), gz.getvalue()


def build(wasm_path, out, tag, variant):
    with open(wasm_path, "rb") as f:
        wasm = f.read()
    if not wasm.startswith(WASM_MAGIC):
        sys.exit(f"{wasm_path}: not a wasm module (missing \\0asm magic)")
    if os.path.exists(out):
        shutil.rmtree(out)
    lay = Layout(out)
    runtime_config = {"type": "envoy_proxy", "abiVersions": ["0.2.1"], "config": {"rootIds": ROOT_IDS}}
    annotations = {"org.opencontainers.image.title": "kvmesh-filter", "org.opencontainers.image.version": tag}
    if variant == "compat":
        tar, gz = compat_layer(wasm)
        layer = lay.put(gz, OCI_LAYER_MT)
        config = {
            "architecture": "wasm",
            "os": "wasip1",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": ["sha256:" + sha256(tar)]},
        }
        config_desc = lay.put(canonical(config), OCI_CONFIG_MT)
        layers = [layer]
        annotations[VARIANT_ANNOTATION] = "compat"
    else:
        config_desc = lay.put(canonical(runtime_config), WASM_CONFIG_MT)
        layers = [
            lay.put(canonical(runtime_config), WASM_CONFIG_MT, {TITLE: "runtime-config.json"}),
            lay.put(wasm, WASM_LAYER_MT, {TITLE: "plugin.wasm"}),
        ]
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_MT, "config": config_desc, "layers": layers, "annotations": annotations}
    manifest_desc = lay.put(canonical(manifest), MANIFEST_MT, {REF_NAME: tag})
    index = {"schemaVersion": 2, "mediaType": INDEX_MT, "manifests": [manifest_desc]}
    with open(os.path.join(out, "oci-layout"), "wb") as f:
        f.write(canonical(OCI_LAYOUT))
    with open(os.path.join(out, "index.json"), "wb") as f:
        f.write(canonical(index))
    return manifest_desc["digest"], sha256(wasm)


def read_blob(root, desc):
    digest = desc["digest"]
    if not digest.startswith("sha256:"):
        raise ValueError(f"unsupported digest {digest}")
    path = os.path.join(root, "blobs", "sha256", digest[7:])
    with open(path, "rb") as f:
        data = f.read()
    if sha256(data) != digest[7:]:
        raise ValueError(f"{path}: content does not match its digest")
    if len(data) != desc["size"]:
        raise ValueError(f"{path}: size {len(data)} != descriptor size {desc['size']}")
    return data


def check(root, wasm_path=None):
    """Returns (tag, variant, module bytes) or raises ValueError."""
    with open(os.path.join(root, "oci-layout")) as f:
        if json.load(f).get("imageLayoutVersion") != "1.0.0":
            raise ValueError("oci-layout: imageLayoutVersion must be 1.0.0")
    with open(os.path.join(root, "index.json")) as f:
        index = json.load(f)
    if index.get("schemaVersion") != 2 or len(index.get("manifests", [])) != 1:
        raise ValueError("index.json: expected schemaVersion 2 and exactly one manifest")
    mdesc = index["manifests"][0]
    if mdesc.get("mediaType") != MANIFEST_MT:
        raise ValueError(f"index.json: manifest media type {mdesc.get('mediaType')}")
    tag = mdesc.get("annotations", {}).get(REF_NAME)
    if not tag:
        raise ValueError(f"index.json: manifest without {REF_NAME}")
    manifest = json.loads(read_blob(root, mdesc))
    if manifest.get("schemaVersion") != 2 or manifest.get("mediaType") != MANIFEST_MT:
        raise ValueError("manifest: schemaVersion/mediaType")
    read_blob(root, manifest["config"])
    layers = manifest["layers"]
    if manifest.get("annotations", {}).get(VARIANT_ANNOTATION) == "compat":
        variant = "compat"
        if manifest["config"]["mediaType"] != OCI_CONFIG_MT or len(layers) != 1 or layers[0]["mediaType"] != OCI_LAYER_MT:
            raise ValueError("compat variant: one tar+gzip layer and an OCI image config expected")
        with tarfile.open(fileobj=io.BytesIO(read_blob(root, layers[0])), mode="r:gz") as tar:
            member = tar.getmember("plugin.wasm")
            handle = tar.extractfile(member)
            if handle is None:
                raise ValueError("plugin.wasm is not a regular file")
            module = handle.read()
    else:
        variant = "artifact"
        if len(layers) != 2:
            raise ValueError("artifact variant: exactly two layers expected (Istio's rule)")
        wasm_layers = [l for l in layers if l["mediaType"] == WASM_LAYER_MT]
        if len(wasm_layers) != 1 or not any(l["mediaType"] == WASM_CONFIG_MT for l in layers):
            raise ValueError("artifact variant: one wasm content layer and one runtime config layer expected")
        json.loads(read_blob(root, next(l for l in layers if l["mediaType"] == WASM_CONFIG_MT)))
        module = read_blob(root, wasm_layers[0])
    if not module.startswith(WASM_MAGIC):
        raise ValueError("the packaged module is not wasm")
    if wasm_path is not None:
        with open(wasm_path, "rb") as f:
            if f.read() != module:
                raise ValueError(f"packaged module differs from {wasm_path}")
    return tag, variant, mdesc["digest"], module


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wasm", help="kvmesh_filter.wasm to package (or compare with --check)")
    p.add_argument("--out", help="OCI layout directory to (re)create")
    p.add_argument("--tag", default="0.1.0")
    p.add_argument("--variant", choices=["compat", "artifact"], default="compat")
    p.add_argument("--http-out", help="also copy the module here with a .sha256 file (https:// / file:// URLs)")
    p.add_argument("--check", metavar="DIR", help="verify an OCI layout instead of building one")
    a = p.parse_args()
    if a.check:
        try:
            tag, variant, digest, module = check(a.check, a.wasm)
        except (OSError, ValueError, KeyError, tarfile.TarError, json.JSONDecodeError) as e:
            sys.exit(f"{a.check}: invalid wasm OCI layout: {e}")
        print(f"{a.check}: OK ({variant} variant, tag {tag}, manifest {digest}, module sha256 {sha256(module)})")
        return
    if not a.wasm or not a.out:
        p.error("--wasm and --out are required to build")
    digest, module_digest = build(a.wasm, a.out, a.tag, a.variant)
    print(f"OCI layout  {a.out}  ({a.variant} variant, tag {a.tag})")
    print(f"manifest    {digest}     ← WasmPlugin sha256 for oci:// (without 'sha256:')")
    print(f"module      sha256:{module_digest}  ← sha256 for https:// and file:// URLs")
    print(f"push        skopeo copy oci:{a.out}:{a.tag} docker://REGISTRY/kvmesh/kvmesh-filter:{a.tag}")
    if a.http_out:
        os.makedirs(a.http_out, exist_ok=True)
        dst = os.path.join(a.http_out, os.path.basename(a.wasm))
        shutil.copyfile(a.wasm, dst)
        with open(dst + ".sha256", "w") as f:
            f.write(f"{module_digest}  {os.path.basename(a.wasm)}\n")
        print(f"http        {dst} (+ .sha256)")


if __name__ == "__main__":
    main()
