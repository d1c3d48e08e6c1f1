# S3 checkpoint bucket(s), only with enable_aws = true: one in aws_region, optionally a second
# one in aws_secondary_region for cross-region restore tests. Each is the module in
# modules/s3_bucket (public access blocked, SSE-KMS default encryption, bucket owner enforced,
# TLS only, incomplete multipart uploads aborted after a day, scratch prefix expiring).

data "aws_caller_identity" "current" {
  count = var.enable_aws ? 1 : 0
}

locals {
  s3_bucket_name = var.enable_aws ? coalesce(var.s3_bucket_name, "${var.name_prefix}-${data.aws_caller_identity.current[0].account_id}-${var.aws_region}") : null
  s3_secondary   = var.enable_aws && var.aws_secondary_region != null
}

module "s3_primary" {
  source = "./modules/s3_bucket"
  count  = var.enable_aws ? 1 : 0

  name           = local.s3_bucket_name
  kms_key_arn    = var.s3_kms_key_arn
  scratch_prefix = var.scratch_prefix
  expiry_days    = var.scratch_expiry_days
  force_destroy  = var.force_destroy
}

module "s3_secondary" {
  source = "./modules/s3_bucket"
  count  = local.s3_secondary ? 1 : 0
  providers = {
    aws = aws.secondary
  }

  name           = var.s3_bucket_name != null ? "${var.s3_bucket_name}-xr" : "${var.name_prefix}-${data.aws_caller_identity.current[0].account_id}-${var.aws_secondary_region}"
  kms_key_arn    = var.s3_secondary_kms_key_arn
  scratch_prefix = var.scratch_prefix
  expiry_days    = var.scratch_expiry_days
  force_destroy  = var.force_destroy
}
