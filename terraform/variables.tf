# ---------------------------------------------------------------------------------------------
# GCP: project, place, buckets
# ---------------------------------------------------------------------------------------------

variable "project" {
  description = "GCP project ID that holds the buckets, the runner's service account and the TPU VM."
  type        = string
}

variable "zone" {
  description = "Zone of the TPU VM. The checkpoint bucket is created in this zone's region, so the runner reads and writes it without cross-region traffic. It must offer var.accelerator_type (v5e: e.g. us-west4-a, us-east5-b, us-central1-a, europe-west4-b)."
  type        = string
  default     = "us-west4-a"

  validation {
    condition     = can(regex("^[a-z]+-[a-z]+[0-9]+-[a-z]$", var.zone))
    error_message = "zone must look like us-west4-a."
  }
}

variable "name_prefix" {
  description = "Prefix of every resource name (buckets, service account, TPU VM, IAM role). Lowercase letters, digits and dashes."
  type        = string
  default     = "objckpt"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{2,14}$", var.name_prefix))
    error_message = "name_prefix must be 3-15 characters: lowercase letters, digits, dashes, starting with a letter."
  }
}

variable "gcs_bucket_name" {
  description = "Name of the GCS checkpoint bucket. Default: <name_prefix>-<project>-ckpt (bucket names are global; project IDs are unique)."
  type        = string
  default     = null

  validation {
    condition     = var.gcs_bucket_name == null || can(regex("^[a-z0-9][a-z0-9_-]{1,56}[a-z0-9]$", var.gcs_bucket_name))
    error_message = "gcs_bucket_name: 3-58 lowercase letters, digits, dashes, underscores (room for the -xr suffix)."
  }
}

variable "gcs_secondary_location" {
  description = "Region of an optional second GCS bucket for cross-region restore tests (e.g. us-east1), named <primary>-xr. null: no second bucket."
  type        = string
  default     = null
}

variable "scratch_prefix" {
  description = "Object prefix for temporary data: the runner's benchmark checkpoints go here, and a lifecycle rule deletes anything under it after scratch_expiry_days. Checkpoints you keep belong elsewhere in the bucket."
  type        = string
  default     = "tmp/"

  validation {
    condition     = can(regex("^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*/$", var.scratch_prefix))
    error_message = "scratch_prefix must be a relative prefix ending in '/', e.g. tmp/ or scratch/bench/."
  }
}

variable "scratch_expiry_days" {
  description = "Age in days after which objects under scratch_prefix are deleted (stale benchmark checkpoints, orphaned blobs of crashed saves), and after which incomplete multipart uploads are aborted everywhere in the bucket."
  type        = number
  default     = 1

  validation {
    condition     = var.scratch_expiry_days >= 1 && floor(var.scratch_expiry_days) == var.scratch_expiry_days
    error_message = "scratch_expiry_days must be a whole number of days, at least 1."
  }
}

variable "gcs_soft_delete_seconds" {
  description = "GCS soft-delete retention in seconds. 0 (default) turns soft delete off: checkpoints churn (save, keep N, delete), and every deleted byte would otherwise be billed for 7 more days. GCS accepts 0 or 604800-7776000."
  type        = number
  default     = 0

  validation {
    condition     = var.gcs_soft_delete_seconds == 0 || (var.gcs_soft_delete_seconds >= 604800 && var.gcs_soft_delete_seconds <= 7776000)
    error_message = "gcs_soft_delete_seconds must be 0 or between 604800 (7 days) and 7776000 (90 days)."
  }
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete the buckets with their contents (checkpoints and results). Set false to protect real checkpoints from a destroy."
  type        = bool
  default     = true
}

variable "enable_apis" {
  description = "Enable the project APIs this needs (Cloud TPU, Cloud Storage, IAM, Compute Engine for the network). They are left enabled on destroy."
  type        = bool
  default     = true
}

variable "labels" {
  description = "Labels (GCP) and tags (AWS) put on every resource that takes them."
  type        = map(string)
  default = {
    app     = "objckpt"
    purpose = "checkpoint-bench"
  }
}

# ---------------------------------------------------------------------------------------------
# GCP: the TPU VM benchmark runner
# ---------------------------------------------------------------------------------------------

variable "create_runner" {
  description = "Create the TPU VM that runs benchmarks/ against the bucket. false: buckets and permissions only (nothing billed by the hour)."
  type        = bool
  default     = true
}

variable "accelerator_type" {
  description = "TPU type of the runner. Single-host types only (one VM: v5litepod-1/4/8, v4-8, v6e-1/4/8 ...): the startup script runs on worker 0 as one JAX process. benchmarks/demo.py builds a (4, 2) mesh, so with TPU JAX it needs 8 devices (v5litepod-8, v6e-8); for other types set jax_platforms = \"cpu\"."
  type        = string
  default     = "v5litepod-8"

  validation {
    condition     = can(regex("^v[0-9][a-z0-9]*-[0-9]+$", var.accelerator_type))
    error_message = "accelerator_type must look like v5litepod-8, v4-8 or v6e-8."
  }
}

variable "runtime_version" {
  description = "TPU VM software version (the image): v2-alpha-tpuv5-lite for v5e, v2-alpha-tpuv6e for v6e, tpu-ubuntu2204-base for v4/v5p. `gcloud compute tpus tpu-vm versions list --zone ZONE` lists them."
  type        = string
  default     = "v2-alpha-tpuv5-lite"
}

variable "preemptible" {
  description = "Create the TPU VM as preemptible (cheaper; may be stopped at any time, which cuts a run short)."
  type        = bool
  default     = false
}

variable "network" {
  description = "Existing VPC network for the TPU VM (name or self link). null (default): a dedicated network is created (network.tf): a subnet with Private Google Access (GCS without leaving Google's network, no external IP needed) and Cloud NAT for the downloads (git, PyPI)."
  type        = string
  default     = null
}

variable "subnetwork" {
  description = "Existing subnetwork for the TPU VM, with var.network. null: the one named like the network. Without an external IP it needs Private Google Access (GCS) and Cloud NAT (git, PyPI)."
  type        = string
  default     = null
}

variable "subnet_cidr" {
  description = "IP range of the dedicated subnet (only when network is null)."
  type        = string
  default     = "10.42.0.0/24"

  validation {
    condition     = can(cidrhost(var.subnet_cidr, 0))
    error_message = "subnet_cidr must be a CIDR block such as 10.42.0.0/24."
  }
}

variable "enable_external_ips" {
  description = "Give the TPU VM an external IP. Default false: the VM is reachable only through IAP and reaches the internet through Cloud NAT. true is only needed with your own network that has no NAT."
  type        = bool
  default     = false
}

variable "allow_iap_ssh" {
  description = "On the dedicated network, allow SSH from Google's IAP range only (35.235.240.0/20), so `gcloud compute tpus tpu-vm ssh --tunnel-through-iap` can follow a run. Nothing else may connect in."
  type        = bool
  default     = true
}

variable "repo_url" {
  description = "Git URL the runner clones objckpt from (https; public, or reachable from the VM without credentials)."
  type        = string

  validation {
    condition     = can(regex("^https://[A-Za-z0-9._~:/@%+-]+$", var.repo_url))
    error_message = "repo_url must be an https:// URL without spaces or quotes."
  }
}

variable "repo_ref" {
  description = "Branch, tag or commit of repo_url to benchmark."
  type        = string
  default     = "main"

  validation {
    condition     = can(regex("^[A-Za-z0-9._/-]+$", var.repo_ref))
    error_message = "repo_ref must be a branch, tag or commit (letters, digits, . _ / -)."
  }
}

variable "install_jax_tpu" {
  description = "Install jax[tpu] (libtpu) into the runner's environment, so benchmarks save from and restore onto the TPU's HBM. false: JAX on the host CPU only."
  type        = bool
  default     = true
}

variable "jax_platforms" {
  description = "JAX_PLATFORMS for the benchmarks: \"\" lets JAX pick (the TPU when installed), \"cpu\" forces 8 host CPU devices (any accelerator type)."
  type        = string
  default     = ""

  validation {
    condition     = contains(["", "cpu", "tpu"], var.jax_platforms)
    error_message = "jax_platforms must be \"\", \"cpu\" or \"tpu\"."
  }
}

variable "benchmark_commands" {
  description = <<-EOT
    Commands the runner runs, one after another, from the repository root inside its .venv. Each
    sees CKPT_URL (gs://BUCKET/<scratch_prefix>bench/<run id>), XR_URL (the same in the second
    bucket, empty without one) and RESULTS_DIR (a directory uploaded to the bucket). A command's
    output goes to RESULTS_DIR/NN.log; a command that is skipped or fails does not stop the others.
    benchmarks/demo.py and benchmarks/bench_rivals.py (--url) take a bucket URL; the others run
    against local servers. bench_rivals writes its tables to benchmarks/results/, which is uploaded.
  EOT
  type        = list(string)
  default = [
    "python -m benchmarks.demo --mib 256 \"$CKPT_URL\"",
    "python -m benchmarks.demo --mib 2048 \"$CKPT_URL\"",
    "if [ -n \"$XR_URL\" ]; then python -m benchmarks.demo --mib 2048 \"$XR_URL\"; else echo 'no second bucket: skipped'; fi",
    "python -m pip install -q orbax-checkpoint || echo 'no orbax-checkpoint: Orbax is reported as skipped'; python -m benchmarks.bench_rivals --url \"$CKPT_URL\" --workloads medium,large --systems raw,objckpt,orbax,naive --name peers-bucket",
  ]

  validation {
    condition     = alltrue([for c in var.benchmark_commands : !strcontains(c, "\n") && trimspace(c) != "OBJCKPT_COMMANDS"])
    error_message = "benchmark_commands: one line each (join several with && or ;)."
  }
}

variable "benchmark_timeout_minutes" {
  description = "Each benchmark command is stopped after this many minutes (the next one still runs)."
  type        = number
  default     = 60

  validation {
    condition     = var.benchmark_timeout_minutes >= 1 && floor(var.benchmark_timeout_minutes) == var.benchmark_timeout_minutes
    error_message = "benchmark_timeout_minutes must be a whole number, at least 1."
  }
}

# ---------------------------------------------------------------------------------------------
# AWS (optional)
# ---------------------------------------------------------------------------------------------

variable "enable_aws" {
  description = "Also create the S3 bucket(s) and the IAM role. false (default): no AWS resources and no AWS credentials needed."
  type        = bool
  default     = false
}

variable "aws_region" {
  description = "Region of the S3 checkpoint bucket."
  type        = string
  default     = "us-west-2"
}

variable "aws_secondary_region" {
  description = "Region of an optional second S3 bucket for cross-region restore tests (e.g. us-east-1). null: no second bucket."
  type        = string
  default     = null
}

variable "s3_bucket_name" {
  description = "Name of the S3 checkpoint bucket. Default: <name_prefix>-<account id>-<region>."
  type        = string
  default     = null

  validation {
    condition     = var.s3_bucket_name == null || can(regex("^[a-z0-9][a-z0-9-]{1,56}[a-z0-9]$", var.s3_bucket_name))
    error_message = "s3_bucket_name: 3-58 lowercase letters, digits, dashes (room for the -xr suffix)."
  }
}

variable "s3_kms_key_arn" {
  description = "KMS key for the buckets' default encryption (SSE-KMS with an S3 Bucket Key). null: the AWS-managed key aws/s3. With a customer key here the role is also allowed to use that key (and only it)."
  type        = string
  default     = null
}

variable "s3_secondary_kms_key_arn" {
  description = "KMS key for the second S3 bucket (a key lives in one region). null: aws/s3 of that region."
  type        = string
  default     = null
}

variable "aws_trusted_principal_arns" {
  description = "IAM principals (users, roles, accounts) allowed to assume the checkpoint role, besides EC2 instances that carry its instance profile."
  type        = list(string)
  default     = []
}
