# GCS checkpoint bucket(s): one next to the TPU VM, optionally a second one in another region for
# cross-region restore tests (docs/REGIONS.md). Both are configured identically.

resource "google_project_service" "apis" {
  for_each = var.enable_apis ? toset(["storage.googleapis.com", "iam.googleapis.com", "tpu.googleapis.com", "compute.googleapis.com"]) : toset([])

  service            = each.value
  disable_on_destroy = false # other things in the project may use them
}

resource "google_storage_bucket" "ckpt" {
  for_each = local.gcs_buckets

  # checkov:skip=CKV_GCP_62:Access logs: a checkpoint writes thousands of objects per save, so usage logs would cost more than the data they describe; Cloud Audit Logs (admin activity) still record IAM and bucket changes.
  # checkov:skip=CKV_GCP_78:Versioning off on purpose: checkpoints churn (save, keep N, delete), versions would keep every deleted byte billed; objckpt never overwrites an object in place (the manifest is create-if-absent), so versioning protects nothing.
  name          = each.value.name
  location      = each.value.location
  storage_class = "STANDARD"
  force_destroy = var.force_destroy
  labels        = var.labels

  # Security: IAM only (no object ACLs) and never public, whatever the org policy says.
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  # Encryption at rest: Google-managed keys (always on for GCS; no setting needed).

  versioning {
    enabled = false
  }

  # Deleted checkpoints are gone at once instead of being billed for 7 more days (0 = off).
  soft_delete_policy {
    retention_duration_seconds = var.gcs_soft_delete_seconds
  }

  # Stale temporary objects: everything under the scratch prefix (the runner's benchmark
  # checkpoints, blobs of crashed saves there) is deleted after scratch_expiry_days.
  lifecycle_rule {
    condition {
      age            = var.scratch_expiry_days
      matches_prefix = [var.scratch_prefix]
    }
    action {
      type = "Delete"
    }
  }

  # XML-API multipart uploads (obstore writes through the XML API) that a crashed save never
  # completed or aborted: their parts are billed until aborted.
  lifecycle_rule {
    condition {
      age = var.scratch_expiry_days
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }

  depends_on = [google_project_service.apis]
}
