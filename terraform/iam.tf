# Identities that can read and write checkpoints in these buckets, and nothing else: every grant
# below is on a bucket (GCP) or names the buckets' ARNs (AWS). Nothing is granted on the project
# or account.

# ---------------------------------------------------------------------------------------------
# GCP: the runner's service account, object read/write on each checkpoint bucket only
# ---------------------------------------------------------------------------------------------

resource "google_service_account" "runner" {
  account_id   = "${var.name_prefix}-runner"
  display_name = "objckpt checkpoint read/write (benchmark runner)"
  description  = "Reads and writes objects in the objckpt checkpoint bucket(s) only; no project-level roles."

  depends_on = [google_project_service.apis]
}

# roles/storage.objectUser: get, list, create, overwrite, delete objects and run multipart
# uploads, on this bucket only; unlike roles/storage.objectAdmin it cannot read or change IAM
# policies, and it gives nothing on the bucket's own settings.
resource "google_storage_bucket_iam_member" "runner_objects" {
  for_each = google_storage_bucket.ckpt

  bucket = each.value.name
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.runner.email}"
}

# ---------------------------------------------------------------------------------------------
# AWS: a role with object read/write on the checkpoint bucket(s) only
# ---------------------------------------------------------------------------------------------

locals {
  s3_bucket_arns = concat(module.s3_primary[*].arn, module.s3_secondary[*].arn)
  s3_kms_keys    = compact([var.s3_kms_key_arn, var.s3_secondary_kms_key_arn])
}

data "aws_iam_policy_document" "assume" {
  count = var.enable_aws ? 1 : 0

  statement {
    sid     = "Ec2InstanceProfile"
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }

  dynamic "statement" {
    for_each = length(var.aws_trusted_principal_arns) > 0 ? [1] : []
    content {
      sid     = "TrustedPrincipals"
      actions = ["sts:AssumeRole"]
      principals {
        type        = "AWS"
        identifiers = var.aws_trusted_principal_arns
      }
    }
  }
}

resource "aws_iam_role" "ckpt" {
  count = var.enable_aws ? 1 : 0

  name               = "${var.name_prefix}-ckpt"
  description        = "Reads and writes objects in the objckpt checkpoint bucket(s) only."
  assume_role_policy = data.aws_iam_policy_document.assume[0].json
}

data "aws_iam_policy_document" "ckpt" {
  count = var.enable_aws ? 1 : 0

  # Listing (objckpt ls/gc, CheckpointManager) and finding stray multipart uploads.
  statement {
    sid       = "ListCheckpointBuckets"
    actions   = ["s3:ListBucket", "s3:ListBucketMultipartUploads"]
    resources = local.s3_bucket_arns
  }

  # Objects: save (PUT, multipart), restore (GET, ranged GET), rm/gc (DELETE).
  statement {
    sid = "ReadWriteCheckpointObjects"
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ]
    resources = [for arn in local.s3_bucket_arns : "${arn}/*"]
  }

  # Only with customer-managed keys: use exactly those keys, and only through S3.
  dynamic "statement" {
    for_each = length(local.s3_kms_keys) > 0 ? [1] : []
    content {
      sid       = "UseBucketKmsKeys"
      actions   = ["kms:GenerateDataKey", "kms:Decrypt"]
      resources = local.s3_kms_keys
      condition {
        test     = "StringLike"
        variable = "kms:ViaService"
        values   = ["s3.*.amazonaws.com"]
      }
    }
  }
}

resource "aws_iam_role_policy" "ckpt" {
  count = var.enable_aws ? 1 : 0

  name   = "checkpoint-buckets-read-write"
  role   = aws_iam_role.ckpt[0].id
  policy = data.aws_iam_policy_document.ckpt[0].json
}

# For running the benchmarks on an EC2 instance: launch it with this instance profile.
resource "aws_iam_instance_profile" "ckpt" {
  count = var.enable_aws ? 1 : 0

  name = "${var.name_prefix}-ckpt"
  role = aws_iam_role.ckpt[0].name
}
