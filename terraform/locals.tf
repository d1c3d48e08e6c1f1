locals {
  # The zone's region: us-west4-a -> us-west4. The checkpoint bucket lives here, next to the TPU VM.
  region = join("-", slice(split("-", var.zone), 0, 2))

  gcs_bucket_name = coalesce(var.gcs_bucket_name, "${var.name_prefix}-${var.project}-ckpt")

  # Every GCS bucket: the primary one, and the cross-region one when asked for.
  gcs_buckets = merge(
    { primary = { name = local.gcs_bucket_name, location = upper(local.region) } },
    var.gcs_secondary_location == null ? {} : {
      secondary = { name = "${local.gcs_bucket_name}-xr", location = upper(var.gcs_secondary_location) }
    },
  )

  runner_name = "${var.name_prefix}-bench"
}
