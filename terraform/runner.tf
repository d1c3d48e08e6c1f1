# The benchmark runner: a single-host TPU VM that, at first boot, clones objckpt, installs it,
# runs var.benchmark_commands against the checkpoint bucket and uploads what they printed and
# wrote to gs://BUCKET/results/<run id>/ (a DONE or FAILED marker last). It runs as the runner
# service account, which can touch objects in the checkpoint bucket(s) and nothing else.
# It keeps billing until `terraform destroy` (or create_runner = false and apply).

locals {
  runner_run_prefix = "${var.scratch_prefix}bench"

  # Everything the startup script gets from Terraform (tests/test_terraform.py checks that these
  # names and the template's ${...} names agree).
  startup_vars = {
    repo_url           = var.repo_url
    repo_ref           = var.repo_ref
    bucket             = local.gcs_bucket_name
    xr_bucket          = var.gcs_secondary_location == null ? "" : "${local.gcs_bucket_name}-xr"
    run_prefix         = local.runner_run_prefix
    install_jax_tpu    = var.install_jax_tpu ? "1" : "0"
    jax_platforms      = var.jax_platforms
    benchmark_commands = join("\n", var.benchmark_commands)
    timeout_minutes    = var.benchmark_timeout_minutes
  }
}

resource "google_tpu_v2_vm" "runner" {
  provider = google-beta
  count    = var.create_runner ? 1 : 0

  name             = local.runner_name
  zone             = var.zone
  accelerator_type = var.accelerator_type
  runtime_version  = var.runtime_version
  description      = "objckpt benchmark runner: runs benchmarks/ against gs://${local.gcs_bucket_name}"
  labels           = var.labels

  service_account {
    email = google_service_account.runner.email
    # The scope only caps what the VM's token may be used for; what the account can actually
    # do is its IAM grants (objects in the checkpoint buckets, nothing else).
    scope = ["https://www.googleapis.com/auth/cloud-platform"]
  }

  network_config {
    network             = local.runner_network
    subnetwork          = local.runner_subnetwork
    enable_external_ips = var.enable_external_ips
  }

  scheduling_config {
    preemptible = var.preemptible
  }

  metadata = {
    startup-script = templatefile("${path.module}/startup.sh.tftpl", local.startup_vars)
  }

  # The service account must be able to write to the bucket, and the VM must reach PyPI through
  # NAT, before the startup script runs.
  depends_on = [
    google_project_service.apis,
    google_storage_bucket_iam_member.runner_objects,
    google_compute_router_nat.runner,
  ]
}
