# One S3 checkpoint bucket with everything that makes it safe to checkpoint to: no public
# access, default encryption, bucket-owner-enforced ownership (no ACLs), TLS only, and lifecycle
# rules for incomplete multipart uploads and stale scratch objects. Used once per region by
# ../../s3.tf.

terraform {
  required_providers {
    aws = {
      source = "hashicorp/aws"
    }
  }
}

variable "name" {
  description = "Bucket name (global)."
  type        = string
}

variable "kms_key_arn" {
  description = "KMS key for default encryption; null: the AWS-managed key aws/s3."
  type        = string
  default     = null
}

variable "scratch_prefix" {
  description = "Prefix whose objects expire after expiry_days."
  type        = string
}

variable "expiry_days" {
  description = "Days after which scratch objects expire and incomplete multipart uploads are aborted."
  type        = number
}

variable "force_destroy" {
  description = "Let terraform destroy delete a non-empty bucket."
  type        = bool
}

resource "aws_s3_bucket" "this" {
  # checkov:skip=CKV_AWS_18:Server access logs: a checkpoint writes thousands of objects per save, so access logs would cost more than the data they describe; CloudTrail management events still record bucket changes.
  # checkov:skip=CKV_AWS_21:Versioning off on purpose: checkpoints churn (save, keep N, delete), versions would keep every deleted byte billed; objckpt never overwrites an object in place (the manifest is create-if-absent), so versioning protects nothing.
  # checkov:skip=CKV_AWS_144:Cross-region replication would double every checkpoint's bytes and requests; the optional second bucket (aws_secondary_region) is for cross-region restore tests, written on purpose, not a replica.
  # checkov:skip=CKV2_AWS_62:Event notifications: nothing consumes bucket events; a checkpoint's commit is its manifest.json, which readers poll.
  bucket        = var.name
  force_destroy = var.force_destroy
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket = aws_s3_bucket.this.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    # A Bucket Key makes S3 call KMS once per key period instead of once per object, so a
    # checkpoint's thousands of PUTs and GETs do not turn into KMS requests (cost, quota).
    bucket_key_enabled = true
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = var.kms_key_arn
    }
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  # Parts of multipart uploads that a crashed save never completed or aborted are billed until
  # aborted.
  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"
    filter {}
    abort_incomplete_multipart_upload {
      days_after_initiation = var.expiry_days
    }
  }

  # Stale temporary objects under the scratch prefix (benchmark checkpoints, orphaned blobs).
  rule {
    id     = "expire-scratch"
    status = "Enabled"
    filter {
      prefix = var.scratch_prefix
    }
    expiration {
      days = var.expiry_days
    }
  }
}

# TLS only: requests over plain HTTP are refused whatever IAM allows.
data "aws_iam_policy_document" "tls_only" {
  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.this.arn, "${aws_s3_bucket.this.arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "tls_only" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.tls_only.json

  # A bucket policy put while the public access block is still being created can race it.
  depends_on = [aws_s3_bucket_public_access_block.this]
}

output "name" {
  description = "The bucket's name (global)."
  value       = aws_s3_bucket.this.id
}

output "arn" {
  description = "The bucket's ARN, for IAM policies."
  value       = aws_s3_bucket.this.arn
}

output "region" {
  description = "The region the bucket is in."
  value       = aws_s3_bucket.this.region
}
