"""terraform/: every file parses, and the security-relevant settings are there.

The terraform CLI and its providers cannot be downloaded here, so this reads the HCL with
python-hcl2 and checks what `terraform validate` cannot anyway: no public access, uniform
access, encryption, bucket-scoped least-privilege grants, pinned providers, and a startup
script that renders and is valid bash. `terraform/check.sh` (checkov) runs next to it in
tests/run.sh.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hcl2  # python-hcl2 (the dev extra)
import pytest

ROOT = Path(__file__).resolve().parent.parent
TF = ROOT / "terraform"
TF_FILES = sorted(TF.rglob("*.tf"))
TEMPLATE = TF / "startup.sh.tftpl"
S3_MODULE = "./modules/s3_bucket"


def _load(path: Path) -> dict[str, Any]:
    options = hcl2.SerializationOptions(explicit_blocks=False, strip_string_quotes=True, with_comments=False)
    with path.open() as f:
        return hcl2.load(f, serialization_options=options)


class Config:
    """The blocks of one Terraform module directory, by kind and name."""

    def __init__(self, directory: Path) -> None:
        self.resources: dict[tuple[str, str], dict[str, Any]] = {}
        self.data: dict[tuple[str, str], dict[str, Any]] = {}
        self.variables: dict[str, dict[str, Any]] = {}
        self.outputs: dict[str, dict[str, Any]] = {}
        self.locals: dict[str, Any] = {}
        self.modules: dict[str, dict[str, Any]] = {}
        self.providers: list[tuple[str, dict[str, Any]]] = []
        self.terraform: list[dict[str, Any]] = []
        for path in sorted(directory.glob("*.tf")):
            doc = _load(path)
            for kind, target in (("resource", self.resources), ("data", self.data)):
                for item in doc.get(kind, []):
                    for rtype, named in item.items():
                        for name, body in named.items():
                            assert (rtype, name) not in target, f"{kind} {rtype}.{name} defined twice"
                            target[(rtype, name)] = body
            for kind, target in (("variable", self.variables), ("output", self.outputs), ("module", self.modules)):
                for item in doc.get(kind, []):
                    for name, body in item.items():
                        assert name not in target, f"{kind} {name} defined twice"
                        target[name] = body
            for item in doc.get("locals", []):
                self.locals.update(item)
            for item in doc.get("provider", []):
                self.providers.extend(item.items())
            self.terraform.extend(doc.get("terraform", []))

    def resource(self, rtype: str, name: str) -> dict[str, Any]:
        assert (rtype, name) in self.resources, f"missing resource {rtype}.{name}"
        return self.resources[(rtype, name)]

    def of_type(self, rtype: str) -> list[dict[str, Any]]:
        return [body for (t, _), body in self.resources.items() if t == rtype]

    def default(self, variable: str) -> Any:
        return self.variables[variable].get("default")


def _one(blocks: Any) -> dict[str, Any]:
    """A nested block (parsed as a list of bodies) that must appear exactly once."""
    assert isinstance(blocks, list) and len(blocks) == 1, blocks
    return blocks[0]


def _walk(value: Any) -> Iterator[Any]:
    yield value
    if isinstance(value, dict):
        for v in value.values():
            yield from _walk(v)
    elif isinstance(value, list):
        for v in value:
            yield from _walk(v)


@pytest.fixture(scope="module")
def root() -> Config:
    return Config(TF)


@pytest.fixture(scope="module")
def s3_module() -> Config:
    return Config(TF / "modules" / "s3_bucket")


# --------------------------------------------------------------------------------------------
# Parsing, versions, documentation
# --------------------------------------------------------------------------------------------


def test_there_is_terraform() -> None:
    names = {p.relative_to(TF).as_posix() for p in TF_FILES}
    for expected in ("versions.tf", "variables.tf", "outputs.tf", "gcs.tf", "s3.tf", "iam.tf", "runner.tf"):
        assert expected in names
    assert TEMPLATE.is_file()
    assert (TF / "README.md").is_file()


@pytest.mark.parametrize("path", TF_FILES, ids=lambda p: p.relative_to(TF).as_posix())
def test_every_tf_file_parses(path: Path) -> None:
    doc = _load(path)
    assert doc, f"{path} parsed to nothing"


def test_providers_and_terraform_pinned(root: Config) -> None:
    block = _one(root.terraform)
    assert re.fullmatch(r">= ?1\.\d+(\.\d+)?, ?< ?2\.0(\.0)?", block["required_version"])
    required = _one(block["required_providers"])
    assert set(required) == {"google", "google-beta", "aws"}
    for name, spec in required.items():
        assert spec["source"] == f"hashicorp/{name}"
        # `~> X.Y`: the major version cannot change under `terraform init -upgrade`.
        assert re.fullmatch(r"~> ?\d+\.\d+", spec["version"]), (name, spec["version"])


def test_variables_and_outputs_are_described(root: Config, s3_module: Config) -> None:
    for config in (root, s3_module):
        for name, body in config.variables.items():
            assert len(body.get("description", "")) > 15, f"variable {name} needs a description"
            assert "type" in body, f"variable {name} needs a type"
        for name, body in config.outputs.items():
            assert len(body.get("description", "")) > 15, f"output {name} needs a description"
    # Required inputs: only what cannot have a sane default.
    required = {name for name, body in root.variables.items() if "default" not in body}
    assert required == {"project", "repo_url"}


def test_outputs_give_urls_and_commands(root: Config) -> None:
    for name in ("gcs_bucket_url", "s3_bucket_url", "results_url", "fetch_results_command", "runner_service_account"):
        assert name in root.outputs
    assert root.outputs["gcs_bucket_url"]["value"].startswith("gs://")
    assert "gcloud storage" in root.outputs["fetch_results_command"]["value"]
    assert "/results" in root.outputs["fetch_results_command"]["value"]


# --------------------------------------------------------------------------------------------
# GCS
# --------------------------------------------------------------------------------------------


def test_gcs_bucket_is_private_uniform_and_churn_friendly(root: Config) -> None:
    buckets = root.of_type("google_storage_bucket")
    assert len(buckets) == 1, "every GCS bucket comes from the one for_each resource"
    bucket = root.resource("google_storage_bucket", "ckpt")
    assert bucket["for_each"] == "${local.gcs_buckets}"
    assert bucket["uniform_bucket_level_access"] is True
    assert bucket["public_access_prevention"] == "enforced"
    assert _one(bucket["versioning"])["enabled"] is False
    # Soft delete off by default (checkpoints churn).
    assert _one(bucket["soft_delete_policy"])["retention_duration_seconds"] == "${var.gcs_soft_delete_seconds}"
    assert root.default("gcs_soft_delete_seconds") == 0
    # No object ACLs, website, CORS or public IAM anywhere.
    for key in ("website", "cors", "default_acl", "predefined_acl"):
        assert key not in bucket
    for body in root.resources.values():
        for value in _walk(body):
            assert value not in ("allUsers", "allAuthenticatedUsers")


def test_gcs_lifecycle_rules(root: Config) -> None:
    rules = root.resource("google_storage_bucket", "ckpt")["lifecycle_rule"]
    by_action = {_one(r["action"])["type"]: _one(r["condition"]) for r in rules}
    assert by_action["Delete"] == {"age": "${var.scratch_expiry_days}", "matches_prefix": ["${var.scratch_prefix}"]}
    assert by_action["AbortIncompleteMultipartUpload"] == {"age": "${var.scratch_expiry_days}"}
    assert root.default("scratch_expiry_days") == 1
    assert root.default("scratch_prefix") == "tmp/"


def test_gcs_secondary_bucket_is_optional_and_elsewhere(root: Config) -> None:
    assert root.default("gcs_secondary_location") is None
    buckets = root.locals["gcs_buckets"]
    assert "secondary" in buckets and "var.gcs_secondary_location == null" in buckets


# --------------------------------------------------------------------------------------------
# S3
# --------------------------------------------------------------------------------------------


def test_s3_is_optional(root: Config) -> None:
    assert root.default("enable_aws") is False
    assert root.default("aws_secondary_region") is None
    for name, module in root.modules.items():
        assert module["source"] == S3_MODULE, name
    assert root.modules["s3_primary"]["count"] == "${var.enable_aws ? 1 : 0}"
    assert root.modules["s3_secondary"]["count"] == "${local.s3_secondary ? 1 : 0}"
    assert root.locals["s3_secondary"] == "${var.enable_aws && var.aws_secondary_region != null}"
    assert root.modules["s3_secondary"]["providers"] == {"aws": "${aws.secondary}"}
    for (rtype, name), body in root.resources.items():
        if rtype.startswith("aws_"):
            assert body.get("count") == "${var.enable_aws ? 1 : 0}", f"{rtype}.{name} must follow enable_aws"
    for (rtype, name), body in root.data.items():
        if rtype.startswith("aws_"):
            assert body.get("count") == "${var.enable_aws ? 1 : 0}", f"data {rtype}.{name} must follow enable_aws"


def test_s3_bucket_blocks_public_access(s3_module: Config) -> None:
    pab = s3_module.resource("aws_s3_bucket_public_access_block", "this")
    assert pab["bucket"] == "${aws_s3_bucket.this.id}"
    for key in ("block_public_acls", "block_public_policy", "ignore_public_acls", "restrict_public_buckets"):
        assert pab[key] is True, key
    owner = s3_module.resource("aws_s3_bucket_ownership_controls", "this")
    assert _one(owner["rule"])["object_ownership"] == "BucketOwnerEnforced"
    bucket = s3_module.resource("aws_s3_bucket", "this")
    assert "acl" not in bucket and "policy" not in bucket


def test_s3_bucket_default_encryption(s3_module: Config) -> None:
    sse = s3_module.resource("aws_s3_bucket_server_side_encryption_configuration", "this")
    assert sse["bucket"] == "${aws_s3_bucket.this.id}"
    rule = _one(sse["rule"])
    assert rule["bucket_key_enabled"] is True
    default = _one(rule["apply_server_side_encryption_by_default"])
    assert default["sse_algorithm"] == "aws:kms"


def test_s3_bucket_tls_only(s3_module: Config) -> None:
    doc = s3_module.data[("aws_iam_policy_document", "tls_only")]
    statement = _one(doc["statement"])
    assert statement["effect"] == "Deny"
    assert _one(statement["condition"]) == {"test": "Bool", "variable": "aws:SecureTransport", "values": ["false"]}
    policy = s3_module.resource("aws_s3_bucket_policy", "tls_only")
    assert policy["policy"] == "${data.aws_iam_policy_document.tls_only.json}"


def test_s3_lifecycle_aborts_multipart_uploads_after_a_day(root: Config, s3_module: Config) -> None:
    lifecycle = s3_module.resource("aws_s3_bucket_lifecycle_configuration", "this")
    rules = {r["id"]: r for r in lifecycle["rule"]}
    abort = rules["abort-incomplete-multipart-uploads"]
    assert abort["status"] == "Enabled"
    assert _one(abort["filter"]) == {}, "the abort rule covers the whole bucket"
    assert _one(abort["abort_incomplete_multipart_upload"]) == {"days_after_initiation": "${var.expiry_days}"}
    scratch = rules["expire-scratch"]
    assert _one(scratch["filter"]) == {"prefix": "${var.scratch_prefix}"}
    assert _one(scratch["expiration"]) == {"days": "${var.expiry_days}"}
    for module in root.modules.values():
        assert module["expiry_days"] == "${var.scratch_expiry_days}"
        assert module["scratch_prefix"] == "${var.scratch_prefix}"
    assert root.default("scratch_expiry_days") == 1


# --------------------------------------------------------------------------------------------
# Identity: bucket-scoped, least privilege
# --------------------------------------------------------------------------------------------

PROJECT_WIDE_IAM = re.compile(
    r"^google_(project|folder|organization|billing_account)_iam_|^google_.*_iam_(policy|binding)$"
)


def test_gcp_grants_are_bucket_scoped(root: Config) -> None:
    for rtype, name in root.resources:
        assert not PROJECT_WIDE_IAM.search(rtype), f"{rtype}.{name}: nothing project-wide or authoritative"
    members = [(k, v) for k, v in root.resources.items() if k[0].endswith("_iam_member")]
    assert [k for k, _ in members] == [("google_storage_bucket_iam_member", "runner_objects")]
    grant = members[0][1]
    assert grant["for_each"] == "${google_storage_bucket.ckpt}", "one grant per checkpoint bucket, on that bucket"
    assert grant["bucket"] == "${each.value.name}"
    assert grant["role"] in ("roles/storage.objectUser", "roles/storage.objectAdmin")
    assert grant["member"] == "serviceAccount:${google_service_account.runner.email}"


def test_tpu_vm_runs_as_the_runner_service_account(root: Config) -> None:
    vm = root.resource("google_tpu_v2_vm", "runner")
    assert vm["provider"] in ("google-beta", "${google-beta}")
    assert vm["count"] == "${var.create_runner ? 1 : 0}"
    assert _one(vm["service_account"])["email"] == "${google_service_account.runner.email}"
    for key in ("accelerator_type", "runtime_version", "zone"):
        assert vm[key] == f"${{var.{key}}}"
    assert root.default("accelerator_type") == "v5litepod-8"
    assert "${google_storage_bucket_iam_member.runner_objects}" in vm["depends_on"]
    # Private by default: no external IP; in only through IAP.
    assert _one(vm["network_config"])["enable_external_ips"] == "${var.enable_external_ips}"
    assert root.default("enable_external_ips") is False
    subnet = root.resource("google_compute_subnetwork", "runner")
    assert subnet["private_ip_google_access"] is True
    firewall = root.resource("google_compute_firewall", "iap_ssh")
    assert firewall["source_ranges"] == ["35.235.240.0/20"]
    assert firewall["direction"] == "INGRESS"
    assert [_one(firewall["allow"])["ports"]] == [["22"]]


AWS_ALLOWED_ACTIONS = {
    "s3:ListBucket",
    "s3:ListBucketMultipartUploads",
    "s3:GetObject",
    "s3:PutObject",
    "s3:DeleteObject",
    "s3:AbortMultipartUpload",
    "s3:ListMultipartUploadParts",
    "kms:GenerateDataKey",
    "kms:Decrypt",
}


def _statements(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = list(doc.get("statement", []))
    for dynamic in doc.get("dynamic", []):
        out.append(_one(dynamic["statement"]["content"]))
    return out


def test_aws_role_is_limited_to_the_buckets(root: Config) -> None:
    for rtype, name in root.resources:
        assert rtype not in ("aws_iam_policy_attachment", "aws_iam_role_policy_attachment", "aws_iam_user_policy"), (
            f"{rtype}.{name}: no managed policies, only the bucket-scoped inline one"
        )
    role = root.resource("aws_iam_role", "ckpt")
    assert "managed_policy_arns" not in role and "inline_policy" not in role
    policy = root.resource("aws_iam_role_policy", "ckpt")
    assert policy["role"] == "${aws_iam_role.ckpt[0].id}"
    assert policy["policy"] == "${data.aws_iam_policy_document.ckpt[0].json}"

    statements = _statements(root.data[("aws_iam_policy_document", "ckpt")])
    seen: set[str] = set()
    for st in statements:
        assert st.get("effect", "Allow") == "Allow"
        actions = set(st["actions"])
        assert actions <= AWS_ALLOWED_ACTIONS, actions - AWS_ALLOWED_ACTIONS
        assert not any("*" in a for a in actions)
        seen |= actions
        assert "*" not in json.dumps(st["resources"]).replace("/*", ""), "no wildcard resources"
        if any(a.startswith("kms:") for a in actions):
            assert st["resources"] == "${local.s3_kms_keys}"
        elif actions & {"s3:GetObject", "s3:PutObject", "s3:DeleteObject"}:
            assert st["resources"] == '${[for arn in local.s3_bucket_arns : "${arn}/*"]}'
        else:
            assert st["resources"] == "${local.s3_bucket_arns}"
    assert {"s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket", "s3:AbortMultipartUpload"} <= seen
    assert root.locals["s3_bucket_arns"] == "${concat(module.s3_primary[*].arn, module.s3_secondary[*].arn)}"


# --------------------------------------------------------------------------------------------
# The runner's startup script
# --------------------------------------------------------------------------------------------

TEMPLATE_VAR = re.compile(r"(?<!\$)\$\{([^}]*)\}")


def _render(template: str, values: dict[str, str]) -> str:
    """Terraform's templatefile for plain `${name}` interpolation (all this template may use)."""
    assert "%{" not in template.replace("%%{", ""), "no template directives: keep the template plain"

    def sub(match: re.Match[str]) -> str:
        return values[match.group(1).strip()]

    return TEMPLATE_VAR.sub(sub, template).replace("$${", "${").replace("%%{", "%{")


def _default_values(root: Config) -> dict[str, str]:
    commands = list(root.default("benchmark_commands"))
    return {
        "repo_url": "https://github.com/example/objckpt.git",
        "repo_ref": "main",
        "bucket": "objckpt-my-project-ckpt",
        "xr_bucket": "objckpt-my-project-ckpt-xr",
        "run_prefix": "tmp/bench",
        "install_jax_tpu": "1",
        "jax_platforms": "",
        "benchmark_commands": "\n".join(commands),
        "timeout_minutes": "60",
    }


def test_template_variables_match_runner(root: Config) -> None:
    names = {m.group(1).strip() for m in TEMPLATE_VAR.finditer(TEMPLATE.read_text())}
    assert names == set(root.locals["startup_vars"])
    assert names == set(_default_values(root))
    vm = root.resource("google_tpu_v2_vm", "runner")
    assert vm["metadata"]["startup-script"] == '${templatefile("${path.module}/startup.sh.tftpl", local.startup_vars)}'


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_startup_script_renders_to_valid_bash(root: Config, tmp_path: Path) -> None:
    script = _render(TEMPLATE.read_text(), _default_values(root))
    path = tmp_path / "startup.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    for command in _default_values(root)["benchmark_commands"].splitlines():
        subprocess.run(["bash", "-n", "-c", command], check=True)
    # It installs from the repo the way CI does, and sends what it measured to the bucket.
    assert "git clone" in script and ". .ci/setup-env" in script
    assert 'CKPT_URL="gs://$BUCKET/$RUN_PREFIX/$RUN_ID"' in script
    assert 'RESULTS_URL="gs://$BUCKET/results/$RUN_ID"' in script
    assert "gcloud storage rsync" in script


def test_default_commands_target_the_bucket_with_existing_flags(root: Config) -> None:
    commands = list(root.default("benchmark_commands"))
    assert any('"$CKPT_URL"' in c for c in commands), "something must run against the bucket"
    assert any('"$XR_URL"' in c for c in commands)
    for command in commands:
        for module, args in re.findall(r"python -m (benchmarks\.\w+)((?: --?[\w-]+(?: [^\s;-]\S*)?)*)", command):
            source = ROOT / (module.replace(".", "/") + ".py")
            assert source.is_file(), f"{command}: no {source}"
            for flag in re.findall(r"--[\w-]+", args):
                assert f'"{flag}"' in source.read_text(), f"{command}: {module} has no {flag}"


def test_runner_uses_a_scratch_prefix_that_expires(root: Config) -> None:
    assert root.locals["runner_run_prefix"] == "${var.scratch_prefix}bench"
    assert root.locals["startup_vars"]["run_prefix"] == "${local.runner_run_prefix}"


# --------------------------------------------------------------------------------------------
# checkov skips are justified
# --------------------------------------------------------------------------------------------


def test_every_checkov_skip_has_a_reason() -> None:
    skips = []
    for path in TF_FILES:
        for line in path.read_text().splitlines():
            if "checkov:skip" in line:
                match = re.search(r"#\s*checkov:skip=(CKV2?_[A-Z]+_\d+):(.+)", line)
                assert match, f"{path.name}: malformed skip: {line.strip()}"
                assert len(match.group(2).strip()) >= 40, f"{path.name}: {match.group(1)} needs a real reason"
                skips.append(match.group(1))
    assert len(skips) == len(set(skips)), "each check is skipped once, next to its resource"


# --------------------------------------------------------------------------------------------
# The startup script, run for real: a local repository instead of the clone URL, stubs for the
# metadata server (curl) and for gcloud (the bucket is a directory), paths under tmp_path.
# --------------------------------------------------------------------------------------------

FAKE_CURL = """#!/bin/sh
for a in "$@"; do url="$a"; done
case "$url" in
  */agent-worker-number) echo "$FAKE_WORKER" ;;
  */accelerator-type) echo v5litepod-8 ;;
  *) exit 22 ;;
esac
"""

# gcloud storage rsync --recursive SRC gs://BUCKET/PATH --quiet
FAKE_GCLOUD = """#!/bin/sh
[ "$1 $2 $3" = "storage rsync --recursive" ] || { echo "unexpected gcloud $*" >&2; exit 2; }
dst="$FAKE_GCS/${5#gs://}"
mkdir -p "$dst" && cp -r "$4/." "$dst/"
"""

# Stands in for the repository's .ci/setup-env: the .venv the script made, activated.
FAKE_SETUP_ENV = """root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/.venv/bin/activate"
cd "$root"
"""


@pytest.fixture()
def sandbox(tmp_path: Path) -> dict[str, Any]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("curl", FAKE_CURL), ("gcloud", FAKE_GCLOUD)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / ".ci" / "setup-env").write_text(FAKE_SETUP_ENV)
    (repo / "benchmarks" / "results").mkdir(parents=True)
    (repo / "benchmarks" / "results" / "old.json").write_text("{}")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q", "-b", "bench"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "fake objckpt"], check=True)
    env = {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin:{Path(shutil.which('python3') or '/usr/bin/python3').parent}",
        "HOME": str(tmp_path),
        "OBJCKPT_BENCH_ROOT": str(tmp_path / "vm"),
        "FAKE_GCS": str(tmp_path / "gcs"),
        "FAKE_WORKER": "0",
    }
    return {"tmp": tmp_path, "repo": repo, "env": env}


def _run_startup(sandbox: dict[str, Any], commands: list[str]) -> subprocess.CompletedProcess[str]:
    values = {
        "repo_url": str(sandbox["repo"]),
        "repo_ref": "bench",
        "bucket": "ckpt-bucket",
        "xr_bucket": "",
        "run_prefix": "tmp/bench",
        "install_jax_tpu": "0",
        "jax_platforms": "cpu",
        "benchmark_commands": "\n".join(commands),
        "timeout_minutes": "1",
    }
    script = sandbox["tmp"] / "startup.sh"
    script.write_text(_render(TEMPLATE.read_text(), values))
    return subprocess.run(
        ["bash", str(script)], env=sandbox["env"], capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL
    )


def _the_run(sandbox: dict[str, Any]) -> Path:
    runs = list((sandbox["tmp"] / "gcs" / "ckpt-bucket" / "results").iterdir())
    assert len(runs) == 1, runs
    return runs[0]


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None, reason="needs bash and git")
def test_startup_script_runs_commands_and_uploads_results(sandbox: dict[str, Any]) -> None:
    proc = _run_startup(
        sandbox,
        [
            'echo "ckpt=$CKPT_URL xr=[$XR_URL] platforms=$JAX_PLATFORMS"',
            "# a comment line is skipped",
            "echo boom >&2; exit 3",
            'echo \'{"gib": 1}\' > benchmarks/results/core.json && test -d "$RESULTS_DIR"',
        ],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = _the_run(sandbox)
    files = {p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()}
    assert {"01.log", "02.log", "03.log", "env.txt", "summary.txt", "startup.log", "FAILED"} <= files
    assert "DONE" not in files, "a failed command makes the run FAILED"
    first = (run / "01.log").read_text()
    assert f"ckpt=gs://ckpt-bucket/tmp/bench/{run.name} xr=[] platforms=cpu" in first
    assert "boom" in (run / "02.log").read_text()
    summary = (run / "summary.txt").read_text().splitlines()
    assert [line.split()[1] for line in summary] == ["rc=0", "rc=3", "rc=0"]
    # What the benchmarks wrote during the run comes along; what was there before does not.
    assert "benchmarks-results/benchmarks/results/core.json" in files
    assert not any(f.endswith("old.json") for f in files)
    assert "accelerator: v5litepod-8" in (run / "env.txt").read_text()

    # Startup scripts run at every boot: the second time it does nothing.
    again = _run_startup(sandbox, ["echo second"])
    assert again.returncode == 0 and "already ran" in again.stdout
    assert _the_run(sandbox) == run


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None, reason="needs bash and git")
def test_startup_script_done_marker_and_other_workers(sandbox: dict[str, Any]) -> None:
    sandbox["env"]["FAKE_WORKER"] = "1"
    proc = _run_startup(sandbox, ["echo hello"])
    assert proc.returncode == 0 and "worker 1, nothing to do" in proc.stdout
    assert not (sandbox["tmp"] / "gcs").exists()

    sandbox["env"]["FAKE_WORKER"] = "0"
    proc = _run_startup(sandbox, ["echo hello", "true"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = _the_run(sandbox)
    assert (run / "DONE").is_file() and not (run / "FAILED").exists()
    assert "hello" in (run / "01.log").read_text()
