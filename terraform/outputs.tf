output "gcs_bucket_url" {
  description = "The GCS checkpoint bucket: objckpt.save(\"<this>/run1/step_1000\", state)."
  value       = "gs://${google_storage_bucket.ckpt["primary"].name}"
}

output "gcs_secondary_bucket_url" {
  description = "The cross-region GCS bucket (null without gcs_secondary_location)."
  value       = contains(keys(google_storage_bucket.ckpt), "secondary") ? "gs://${google_storage_bucket.ckpt["secondary"].name}" : null
}

output "gcs_scratch_url" {
  description = "Where temporary checkpoints go (deleted after scratch_expiry_days)."
  value       = "gs://${google_storage_bucket.ckpt["primary"].name}/${var.scratch_prefix}"
}

output "runner_service_account" {
  description = "The service account with object read/write on the GCS bucket(s) only. Impersonate it to test the grants: gcloud storage ls <bucket> --impersonate-service-account=<this>."
  value       = google_service_account.runner.email
}

output "s3_bucket_url" {
  description = "The S3 checkpoint bucket (null unless enable_aws)."
  value       = var.enable_aws ? "s3://${module.s3_primary[0].name}" : null
}

output "s3_secondary_bucket_url" {
  description = "The cross-region S3 bucket (null unless enable_aws and aws_secondary_region)."
  value       = local.s3_secondary ? "s3://${module.s3_secondary[0].name}" : null
}

output "aws_role_arn" {
  description = "The IAM role with object read/write on the S3 bucket(s) only (null unless enable_aws)."
  value       = var.enable_aws ? aws_iam_role.ckpt[0].arn : null
}

output "aws_instance_profile" {
  description = "Launch an EC2 instance with this profile to run the benchmarks against S3 (null unless enable_aws)."
  value       = var.enable_aws ? aws_iam_instance_profile.ckpt[0].name : null
}

output "runner_name" {
  description = "The TPU VM that runs the benchmarks (null unless create_runner)."
  value       = var.create_runner ? google_tpu_v2_vm.runner[0].name : null
}

output "results_url" {
  description = "Each run writes gs://BUCKET/results/<run id>/ here; DONE or FAILED appears in it when the run is over."
  value       = "gs://${google_storage_bucket.ckpt["primary"].name}/results/"
}

output "watch_command" {
  description = "Lists finished runs (their DONE / FAILED markers); empty until the first run ends."
  value       = "gcloud storage ls 'gs://${google_storage_bucket.ckpt["primary"].name}/results/*/DONE' 'gs://${google_storage_bucket.ckpt["primary"].name}/results/*/FAILED'"
}

output "log_command" {
  description = "Follows the run on the TPU VM (null unless create_runner)."
  value       = var.create_runner ? "gcloud compute tpus tpu-vm ssh ${local.runner_name} --project ${var.project} --zone ${var.zone}${var.enable_external_ips ? "" : " --tunnel-through-iap"} --command 'sudo tail -n +1 -f /var/log/objckpt-bench.log'" : null
}

output "fetch_results_command" {
  description = "Copies every run's results to ./objckpt-results/."
  value       = "mkdir -p objckpt-results && gcloud storage rsync --recursive gs://${google_storage_bucket.ckpt["primary"].name}/results objckpt-results"
}
